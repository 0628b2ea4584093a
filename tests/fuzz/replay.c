/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fuzz_daemon.c without libFuzzer: each input named (a directory: each file in it, in name
 * order) runs once through LLVMFuzzerTestOneInput(), so that every build's ctest replays the
 * committed seed corpus, whatever the compiler. An input that breaks one of the target's
 * invariants aborts; the exit status is 0 only if every input ran and there was one at least.
 *
 *   fuzz_replay FILE|DIR...
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Run the input in file @p path. 0, or -1 if it cannot be read. */
static int replay(const char *path)
{
	static uint8_t buf[1 << 20];
	FILE *f = fopen(path, "rb");
	size_t n;

	if (!f) {
		perror(path);
		return -1;
	}
	n = fread(buf, 1, sizeof(buf), f);
	if (ferror(f) || !feof(f)) {
		fprintf(stderr, "fuzz_replay: %s: read error or larger than %zu bytes\n", path,
			sizeof(buf));
		fclose(f);
		return -1;
	}
	fclose(f);
	LLVMFuzzerTestOneInput(buf, n);
	printf("%s: %zu bytes\n", path, n);
	return 0;
}

static int skip_dots(const struct dirent *de)
{
	return de->d_name[0] != '.';
}

int main(int argc, char **argv)
{
	unsigned ran = 0;
	int failed = 0;

	if (argc < 2) {
		fprintf(stderr, "usage: fuzz_replay FILE|DIR...\n");
		return 2;
	}
	LLVMFuzzerInitialize(&argc, &argv);
	for (int i = 1; i < argc; i++) {
		struct dirent **names;
		struct stat st;
		int n;

		if (stat(argv[i], &st) < 0) {
			perror(argv[i]);
			failed = 1;
			continue;
		}
		if (!S_ISDIR(st.st_mode)) {
			failed |= replay(argv[i]) < 0;
			ran++;
			continue;
		}
		n = scandir(argv[i], &names, skip_dots, alphasort);
		if (n < 0) {
			perror(argv[i]);
			failed = 1;
			continue;
		}
		for (int j = 0; j < n; j++) {
			char path[4096];

			snprintf(path, sizeof(path), "%s/%s", argv[i], names[j]->d_name);
			failed |= replay(path) < 0;
			ran++;
			free(names[j]);
		}
		free(names);
	}
	printf("fuzz_replay: %u inputs\n", ran);
	return failed || ran == 0;
}
