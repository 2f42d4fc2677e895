/* A preload that makes this process's CPUID report an AVX2 CPU: no AVX-512, no AVX-VNNI (nor AMX).

   ONNX Runtime's MLAS, numpy, OpenBLAS and attncal's kernels choose their code from CPUID, so in a process
   started with LD_PRELOAD=libcpuid_avx2.so they run the kernels an AVX2-only CPU gets, natively, at full speed
   (benchmarks/int8_cpu_classes.py times them so).  Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID, on Intel
   and AMD CPUs and KVM guests that offer it: the `cpuid_fault` flag) makes every CPUID instruction raise SIGSEGV;
   the handler allows CPUID for itself, runs it, clears the feature bits and steps over the instruction.  The
   setting is per thread and inherited by threads created later; exec resets it (the preload sets it again).
   CPUID run before this constructor (glibc's own start-up) is not masked: glibc's string functions may still use
   AVX-512 (GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX512F,... masks them too).

   cc -O2 -shared -fPIC -o libcpuid_avx2.so cpuid_avx2.c */
#define _GNU_SOURCE
#include <cpuid.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define ARCH_SET_CPUID 0x1012

/* Leaf 7, sub-leaf 0. EBX: AVX512F 16, DQ 17, IFMA 21, PF 26, ER 27, CD 28, BW 30, VL 31. */
#define LEAF7_EBX ((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | (1u << 28) | (1u << 30) | (1u << 31))
/* ECX: AVX512_VBMI 1, VBMI2 6, VNNI 11, BITALG 12, VPOPCNTDQ 14. */
#define LEAF7_ECX ((1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14))
/* EDX: AVX512_4VNNIW 2, 4FMAPS 3, VP2INTERSECT 8, AMX_BF16 22, AVX512_FP16 23, AMX_TILE 24, AMX_INT8 25. */
#define LEAF7_EDX ((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | (1u << 24) | (1u << 25))
/* Leaf 7, sub-leaf 1. EAX: AVX_VNNI 4, AVX512_BF16 5, AVX_IFMA 23; EDX: AVX_VNNI_INT8 4, AVX_NE_CONVERT 5,
   AVX_VNNI_INT16 10. */
#define LEAF7_1_EAX ((1u << 4) | (1u << 5) | (1u << 23))
#define LEAF7_1_EDX ((1u << 4) | (1u << 5) | (1u << 10))

static void on_fault(int sig, siginfo_t *info, void *context) {
  (void)info;
  greg_t *r = ((ucontext_t *)context)->uc_mcontext.gregs;
  const unsigned char *ip = (const unsigned char *)r[REG_RIP];
  if (ip[0] != 0x0f || ip[1] != 0xa2) { /* not CPUID: a real fault, handled as without this library */
    signal(sig, SIG_DFL);
    return;
  }
  unsigned leaf = (unsigned)r[REG_RAX], sub = (unsigned)r[REG_RCX], a, b, c, d;
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
  __cpuid_count(leaf, sub, a, b, c, d);
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
  if (leaf == 7 && sub == 0) {
    b &= ~LEAF7_EBX;
    c &= ~LEAF7_ECX;
    d &= ~LEAF7_EDX;
  } else if (leaf == 7 && sub == 1) {
    a &= ~LEAF7_1_EAX;
    d &= ~LEAF7_1_EDX;
  }
  r[REG_RAX] = a;
  r[REG_RBX] = b;
  r[REG_RCX] = c;
  r[REG_RDX] = d;
  r[REG_RIP] += 2;
}

__attribute__((constructor)) static void mask_cpuid(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigaction(SIGSEGV, &sa, 0);
  syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
}
