/* SPDX-License-Identifier: Apache-2.0 */
/* Publish a 2x3 float32 tensor under a name, then exit: the entry outlives this process. */
#include <stdio.h>

#include <dlpc/dlpc.h>

int main(int argc, char **argv)
{
	const char *name = argc > 1 ? argv[1] : "demo/weights";
	float data[2][3] = {{1, 2, 3}, {4, 5, 6}};
	int64_t shape[2] = {2, 3};
	DLManagedTensorVersioned t = {
		.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION},
		.dl_tensor = {.data = data,
			      .device = {kDLCPU, 0},
			      .ndim = 2,
			      .dtype = {kDLFloat, 32, 1},
			      .shape = shape},
	};
	dlpc_client *c;
	int gen;

	if (dlpc_connect(NULL, &c) < 0) {
		fprintf(stderr, "publish: %s\n", dlpc_last_error());
		return 1;
	}
	/* the data is copied into sealed shared memory; t's deleter (none here) runs at once */
	gen = dlpc_publish(c, name, &t, DLPC_PUBLISH_REPLACE);
	if (gen < 0) {
		fprintf(stderr, "publish: %s\n", dlpc_last_error());
		dlpc_close(c);
		return 1;
	}
	printf("published %s, generation %d\n", name, gen);
	dlpc_close(c);
	return 0;
}
