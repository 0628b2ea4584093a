/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The CUDA driver ABI that libdlpc relies on, printed one fact a line: type sizes, struct
 * layouts, constants and the versioned entry-point names. Built twice, against the toolkit's
 * cuda.h and against client/cuda_api.h's own declarations; the unit_cuda_abi test compares the
 * two outputs (only where a cuda.h is installed).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cuda_api.h"

#define XSTR(x) STR(x)
#define STR(x) #x
#define V(x) printf("%s %lld\n", #x, (long long)(x))
#define NAME(f) printf("%s -> %s\n", #f, XSTR(f))

int main(void)
{
	V(sizeof(CUresult));
	V(sizeof(CUdevice));
	V(sizeof(CUdeviceptr));
	V(sizeof(CUipcMemHandle));
	V(sizeof(CUipcEventHandle));
	V(sizeof(CUuuid));
	V(sizeof(CUmemGenericAllocationHandle));
	V(sizeof(CUmemLocation));
	V(offsetof(CUmemLocation, id));
	V(sizeof(CUmemAllocationProp));
	V(offsetof(CUmemAllocationProp, requestedHandleTypes));
	V(offsetof(CUmemAllocationProp, location));
	V(offsetof(CUmemAllocationProp, win32HandleMetaData));
	V(offsetof(CUmemAllocationProp, allocFlags));
	V(sizeof(CUmemAccessDesc));
	V(offsetof(CUmemAccessDesc, flags));
	V(CUDA_SUCCESS);
	V(CUDA_ERROR_INVALID_VALUE);
	V(CUDA_ERROR_OUT_OF_MEMORY);
	V(CUDA_ERROR_NOT_INITIALIZED);
	V(CUDA_ERROR_NO_DEVICE);
	V(CUDA_ERROR_INVALID_DEVICE);
	V(CUDA_ERROR_INVALID_CONTEXT);
	V(CUDA_ERROR_MAP_FAILED);
	V(CUDA_ERROR_ALREADY_MAPPED);
	V(CUDA_ERROR_OPERATING_SYSTEM);
	V(CUDA_ERROR_INVALID_HANDLE);
	V(CUDA_ERROR_LAUNCH_FAILED);
	V(CUDA_ERROR_NOT_FOUND);
	V(CUDA_ERROR_NOT_READY);
	V(CUDA_ERROR_NOT_SUPPORTED);
	V(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
	V(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
	V(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
	V(CUDA_ERROR_CAPTURED_EVENT);
	V(CU_STREAM_CAPTURE_STATUS_NONE);
	V(CU_STREAM_CAPTURE_STATUS_ACTIVE);
	V(CU_STREAM_CAPTURE_STATUS_INVALIDATED);
	V(CU_STREAM_CAPTURE_MODE_GLOBAL);
	V(CU_STREAM_CAPTURE_MODE_RELAXED);
	V(CUDA_ERROR_UNKNOWN);
	V(CUDA_ERROR_INVALID_IMAGE);
	V(CUDA_ERROR_ILLEGAL_ADDRESS);
	V(CU_IPC_HANDLE_SIZE);
	V(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
	V(CU_EVENT_BLOCKING_SYNC);
	V(CU_EVENT_DISABLE_TIMING);
	V(CU_EVENT_INTERPROCESS);
	V((uintptr_t)CU_STREAM_LEGACY);
	V((uintptr_t)CU_STREAM_PER_THREAD);
	V(CU_STREAM_NON_BLOCKING);
	V(CU_POINTER_ATTRIBUTE_CONTEXT);
	V(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
	V(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE);
	V(CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES);
	V(CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE);
	V(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	V(CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
	V(CU_MEM_ACCESS_FLAGS_PROT_READ);
	V(CU_MEM_LOCATION_TYPE_DEVICE);
	V(CU_MEM_ALLOCATION_TYPE_PINNED);
	V(CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	NAME(cuMemGetAddressRange);
	NAME(cuMemcpyDtoD);
	NAME(cuMemcpyHtoD);
	NAME(cuMemcpyDtoH);
	NAME(cuModuleLoadData);
	NAME(cuModuleGetFunction);
	NAME(cuModuleUnload);
	NAME(cuLaunchKernel);
	NAME(cuCtxPushCurrent);
	NAME(cuCtxPopCurrent);
	NAME(cuDevicePrimaryCtxRelease);
	NAME(cuDeviceGetUuid);
	NAME(cuIpcOpenMemHandle);
	NAME(cuEventDestroy);
	NAME(cuStreamDestroy);
	NAME(cuMemAlloc);
	NAME(cuMemFree);
	NAME(cuStreamWaitEvent);
	NAME(cuLaunchHostFunc);
	NAME(cuEventRecord);
	NAME(cuIpcGetMemHandle);
	NAME(cuMemCreate);
	NAME(cuMemMap);
	NAME(cuEventQuery);
	NAME(cuStreamIsCapturing);
	NAME(cuStreamGetFlags);
	NAME(cuThreadExchangeStreamCaptureMode);
	return 0;
}
