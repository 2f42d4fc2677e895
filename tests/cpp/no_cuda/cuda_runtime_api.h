/* Used only by tests/test_native_trt.py when no CUDA toolkit is installed: the two
 * CUDA runtime types the TensorRT headers name, so that the plugin's host logic
 * compiles.  Never used for a real build. */
#ifndef ATTNCAL_TEST_NO_CUDA_RUNTIME_API_H_
#define ATTNCAL_TEST_NO_CUDA_RUNTIME_API_H_
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
#endif
