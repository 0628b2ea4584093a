/* SPDX-License-Identifier: Apache-2.0 */
/* Attach a published tensor by name and print it; waits up to 5 s for it to appear. */
#include <stdio.h>

#include <dlpc/dlpc.h>

int main(int argc, char **argv)
{
	const char *name = argc > 1 ? argv[1] : "demo/weights";
	dlpc_attach_opts opts = {.size = sizeof(opts), .timeout_ms = 5000};
	DLManagedTensorVersioned *t;
	dlpc_client *c;
	const float *v;
	int gen;

	if (dlpc_connect(NULL, &c) < 0) {
		fprintf(stderr, "attach: %s\n", dlpc_last_error());
		return 1;
	}
	gen = dlpc_attach(c, name, &opts, &t);
	if (gen < 0) {
		fprintf(stderr, "attach: %s\n", dlpc_last_error());
		dlpc_close(c);
		return 1;
	}
	/* the publisher's memory itself, mapped read-only: no copy was made */
	v = t->dl_tensor.data;
	printf("%s generation %d, shape [%lld, %lld]:", name, gen, (long long)t->dl_tensor.shape[0],
	       (long long)t->dl_tensor.shape[1]);
	for (int64_t i = 0; i < t->dl_tensor.shape[0] * t->dl_tensor.shape[1]; i++)
		printf(" %g", v[i]);
	printf("\n");
	t->deleter(t); /* unmaps and releases the reference */
	dlpc_close(c);
	return 0;
}
