/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file dlpack1.h
 * @brief The DLPack 1.x definitions libdlpc needs, for systems whose dlpack.h is older.
 *
 * Debian 12 ships dlpack.h 0.6, which has no versioned tensor. This header includes the system's
 * dlpack.h and, only when that header predates 1.0 (it does not define DLPACK_MAJOR_VERSION),
 * declares the 1.0 additions with the field layout the DLPack specification fixes:
 * DLPackVersion, DLManagedTensorVersioned, the flag bits and the kDLBool type code. A DLPack 1.x
 * header, when one is found first on the include path, is used as it is.
 */
#ifndef DLPC_DLPACK1_H
#define DLPC_DLPACK1_H

#include <stdint.h>
#include <dlpack/dlpack.h>

#ifndef DLPACK_MAJOR_VERSION

/** Major version of the DLPack ABI described here. */
#define DLPACK_MAJOR_VERSION 1
/** Minor version of the DLPack ABI described here. */
#define DLPACK_MINOR_VERSION 0

/** The DLPack ABI version a managed tensor was made for. */
typedef struct {
	uint32_t major; /**< incompatible ABI changes bump this */
	uint32_t minor; /**< compatible additions bump this */
} DLPackVersion;

/** Boolean elements, one byte each (bits = 8). */
enum { kDLBool = 6 };

/** The consumer must not write through dl_tensor.data. */
#define DLPACK_FLAG_BITMASK_READ_ONLY (UINT64_C(1) << 0)
/** The producer made a private copy for this exchange. */
#define DLPACK_FLAG_BITMASK_IS_COPIED (UINT64_C(1) << 1)

/** A DLTensor with its owner's context, deleter, ABI version and flags (DLPack >= 1.0). */
typedef struct DLManagedTensorVersioned {
	DLPackVersion version; /**< ABI version of this struct */
	void *manager_ctx;     /**< the producer's private context */
	/** Releases the tensor; consumers call it exactly once. May be NULL. */
	void (*deleter)(struct DLManagedTensorVersioned *self);
	uint64_t flags; /**< DLPACK_FLAG_BITMASK_* bits */
	DLTensor dl_tensor;
} DLManagedTensorVersioned;

#endif /* !DLPACK_MAJOR_VERSION */

#endif /* DLPC_DLPACK1_H */
