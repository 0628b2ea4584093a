/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A program outside the project, built against an installed libdlpc by tests/install.sh.
 * Usage: consumer publish NAME | consumer attach NAME (the socket from $DLPACKD_SOCKET).
 */
#include <stdio.h>
#include <string.h>

#include <dlpc/dlpc.h>

#define N 1000

int main(int argc, char **argv)
{
	static int32_t data[N];
	int64_t shape[1] = {N};
	DLManagedTensorVersioned *t;
	dlpc_client *c;
	int r;

	if (argc != 3)
		return 2;
	if (dlpc_connect(NULL, &c) < 0) {
		fprintf(stderr, "connect: %s\n", dlpc_last_error());
		return 1;
	}
	if (strcmp(argv[1], "publish") == 0) {
		DLManagedTensorVersioned pub = {
			.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION},
			.dl_tensor = {.data = data,
				      .device = {kDLCPU, 0},
				      .ndim = 1,
				      .dtype = {kDLInt, 32, 1},
				      .shape = shape},
		};

		for (int i = 0; i < N; i++)
			data[i] = i * 7 - 3;
		r = dlpc_publish(c, argv[2], &pub, DLPC_PUBLISH_REPLACE);
	} else {
		dlpc_attach_opts opts = {.size = sizeof(opts), .timeout_ms = 5000};
		const int32_t *v;

		r = dlpc_attach(c, argv[2], &opts, &t);
		if (r > 0) {
			v = t->dl_tensor.data;
			for (int i = 0; i < N; i++)
				if (t->dl_tensor.shape[0] != N || v[i] != i * 7 - 3) {
					fprintf(stderr, "attach: wrong value at %d\n", i);
					r = -1;
					break;
				}
			t->deleter(t);
		}
	}
	if (r < 0)
		fprintf(stderr, "%s: %s\n", argv[1], dlpc_last_error());
	else
		printf("%s %s: generation %d, libdlpc %s\n", argv[1], argv[2], r, dlpc_version());
	dlpc_close(c);
	return r < 0;
}
