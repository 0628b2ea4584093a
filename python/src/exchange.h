/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The DLPack C exchange API table (DLPack 1.2): a type-level capsule "dlpack_exchange_api"
 * through which C consumers convert tensors without calling Python methods. Declared here, from
 * the field layout the DLPack specification fixes, when the dlpack.h in use predates it.
 */
#ifndef DLPACK_IPC_EXCHANGE_H
#define DLPACK_IPC_EXCHANGE_H

#include <dlpc/dlpack1.h>

/* The API version this table follows. */
#define DLPC_EXCHANGE_API_MINOR 2

#if DLPACK_MAJOR_VERSION == 1 && DLPACK_MINOR_VERSION < 2

typedef struct DLPackExchangeAPIHeader {
	DLPackVersion version;			  /* consumers check the major */
	struct DLPackExchangeAPIHeader *prev_api; /* an older table, or NULL */
} DLPackExchangeAPIHeader;

typedef struct DLPackExchangeAPI {
	DLPackExchangeAPIHeader header;
	/* a new tensor like @p prototype (dtype, ndim, shape, device); 0 or -1 after set_error */
	int (*managed_tensor_allocator)(DLTensor *prototype, DLManagedTensorVersioned **out,
					void *error_ctx,
					void (*set_error)(void *error_ctx, const char *kind,
							  const char *message));
	/* an owning tensor for a Python object of the table's type; 0 or -1 with an exception */
	int (*managed_tensor_from_py_object_no_sync)(void *py_object,
						     DLManagedTensorVersioned **out);
	/* a Python object owning @p tensor (stolen); 0 or -1 with an exception */
	int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *tensor,
						   void **out_py_object);
	/* a non-owning DLTensor valid until control returns to Python; may be NULL */
	int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
	/* the producer's current stream for a device (NULL for host memory) */
	int (*current_work_stream)(DLDeviceType device_type, int32_t device_id,
				   void **out_current_stream);
} DLPackExchangeAPI;

#endif

#endif
