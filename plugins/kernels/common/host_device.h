/* ATTNCAL_HD marks a function that both the host and the CUDA kernels call: __host__ __device__
 * under nvcc, nothing for a host compiler, so that the headers of common/ (and the pure host
 * launch choices of cuda/launch_config.h) compile with g++ alone. */
#ifndef ATTNCAL_HOST_DEVICE_H_
#define ATTNCAL_HOST_DEVICE_H_

#ifdef __CUDACC__
#define ATTNCAL_HD __host__ __device__
#else
#define ATTNCAL_HD
#endif

#endif /* ATTNCAL_HOST_DEVICE_H_ */
