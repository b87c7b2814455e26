// pa_tile emulator runtime shim: a stand-in for FlyDSL's libfly_jit_runtime.so.
//
// FlyDSL's JIT host code (MLIR gpu-to-llvm + FlyDSL's LLVM translation) calls the
// mgpu* C ABI below.  The real library forwards to HIP; this one has no GPU
// dependency: "device" memory is host memory (so CPU tensors' data_ptr() values
// are valid kernel pointers), streams and events are placeholders because every
// launch runs to completion synchronously, and module loads and kernel launches
// are handed to Python callbacks (pa_tile.emu.launch) which build the kernarg
// segment and run the emulator.
//
// Every mgpu* symbol the real library exports must exist here: the ExecutionEngine
// resolves the JIT'd host code's references against this library only, and a
// missing symbol aborts the process at engine creation.
// pa_tile.emu.launch.self_test() compares both export lists.
//
// Built by pa_tile.emu.launch with: cc -O2 -fPIC -shared (no other dependency).

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

// Bumped whenever a callback signature below changes; Python refuses a mismatch.
#define PA_EMU_ABI_VERSION 1

// ---------------------------------------------------------------- Python side

// Returns an opaque non-zero module handle.  `nul_terminated` is 1 for
// mgpuModuleLoadJIT (assembly text), 0 for mgpuModuleLoad (sized blob).
typedef uint64_t (*pa_emu_load_fn)(const void *data, uint64_t size, int32_t nul_terminated);
typedef void (*pa_emu_unload_fn)(uint64_t module);
// dims = {grid x,y,z, block x,y,z, cluster x,y,z}.  Returns 0 on success; on
// failure Python has already stored the exception to re-raise after the launch.
typedef int32_t (*pa_emu_launch_fn)(uint64_t module, const char *kernel, const int64_t *dims,
                                    int32_t dynamic_lds, void *stream, void **params,
                                    void **extra, uint64_t nparams);

static pa_emu_load_fn g_load;
static pa_emu_unload_fn g_unload;
static pa_emu_launch_fn g_launch;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

EXPORT int pa_emu_abi_version(void) { return PA_EMU_ABI_VERSION; }

// Passing NULLs detaches Python (done at interpreter exit: engines destroyed
// later must not call into a finalized interpreter).
EXPORT void pa_emu_set_callbacks(pa_emu_load_fn load, pa_emu_unload_fn unload,
                                 pa_emu_launch_fn launch) {
  pthread_mutex_lock(&g_lock);
  g_load = load;
  g_unload = unload;
  g_launch = launch;
  pthread_mutex_unlock(&g_lock);
}

// ---------------------------------------------------------------- modules

typedef struct pa_function {
  struct pa_module *module;
  char *name;
  struct pa_function *next;
} pa_function;

typedef struct pa_module {
  uint64_t handle; // Python's handle; 0 if Python was not attached
  pa_function *functions;
} pa_module;

static pa_module *load_module(const void *data, uint64_t size, int32_t nul_terminated) {
  pa_module *m = (pa_module *)calloc(1, sizeof(*m));
  if (!m)
    return NULL;
  if (g_load)
    m->handle = g_load(data, size, nul_terminated);
  else
    fprintf(stderr, "[pa_tile.emu] module loaded while no emulator is attached; "
                    "its launches will fail\n");
  return m;
}

EXPORT void *mgpuModuleLoad(void *data, size_t size) { return load_module(data, size, 0); }

// gpu-module-to-binary{format=isa} objects arrive here as NUL-terminated
// assembly text (the HIP runtime rejects this path; the emulator wants it).
EXPORT void *mgpuModuleLoadJIT(void *data, int optLevel) {
  (void)optLevel;
  return load_module(data, data ? strlen((const char *)data) : 0, 1);
}

EXPORT void mgpuModuleUnload(void *module) {
  pa_module *m = (pa_module *)module;
  if (!m)
    return;
  if (g_unload && m->handle)
    g_unload(m->handle);
  for (pa_function *f = m->functions; f;) {
    pa_function *next = f->next;
    free(f->name);
    free(f);
    f = next;
  }
  free(m);
}

// Called before every launch, so lookups are cached per module.
EXPORT void *mgpuModuleGetFunction(void *module, const char *name) {
  pa_module *m = (pa_module *)module;
  if (!m || !name)
    return NULL;
  pthread_mutex_lock(&g_lock);
  pa_function *f = m->functions;
  while (f && strcmp(f->name, name) != 0)
    f = f->next;
  if (!f) {
    f = (pa_function *)calloc(1, sizeof(*f));
    if (f) {
      f->module = m;
      f->name = strdup(name);
      f->next = m->functions;
      m->functions = f;
    }
  }
  pthread_mutex_unlock(&g_lock);
  return f;
}

// CompiledFunction.max_blocks_per_cu(): occupancy is a hardware property the
// emulator does not model; FlyDSL turns 0 into a RuntimeError.
EXPORT int mgpuModuleOccupancyMaxActiveBlocks(void *blob, const char *name, int block, int smem) {
  (void)blob; (void)block; (void)smem;
  fprintf(stderr, "[pa_tile.emu] max_blocks_per_cu(%s): occupancy is not modelled by the "
                  "emulator (pa_tile.isa estimates it from the assembly)\n", name ? name : "?");
  return 0;
}

// ---------------------------------------------------------------- launches

static void launch(pa_function *f, const int64_t dims[9], int32_t smem, void *stream,
                   void **params, void **extra, size_t nparams) {
  if (!f) {
    fprintf(stderr, "[pa_tile.emu] launch of a NULL function ignored\n");
    return;
  }
  if (!g_launch || !f->module->handle) {
    fprintf(stderr, "[pa_tile.emu] kernel %s NOT run: no emulator attached\n", f->name);
    return;
  }
  g_launch(f->module->handle, f->name, dims, smem, stream, params, extra, nparams);
}

EXPORT void mgpuLaunchKernel(void *function, intptr_t gridX, intptr_t gridY, intptr_t gridZ,
                             intptr_t blockX, intptr_t blockY, intptr_t blockZ, int32_t smem,
                             void *stream, void **params, void **extra, size_t paramsCount) {
  const int64_t dims[9] = {gridX, gridY, gridZ, blockX, blockY, blockZ, 1, 1, 1};
  launch((pa_function *)function, dims, smem, stream, params, extra, paramsCount);
}

EXPORT void mgpuLaunchClusterKernel(void *function, intptr_t clusterX, intptr_t clusterY,
                                    intptr_t clusterZ, intptr_t gridX, intptr_t gridY,
                                    intptr_t gridZ, intptr_t blockX, intptr_t blockY,
                                    intptr_t blockZ, int32_t smem, void *stream, void **params,
                                    void **extra, size_t paramsCount) {
  const int64_t dims[9] = {gridX, gridY, gridZ, blockX, blockY, blockZ, clusterX, clusterY, clusterZ};
  launch((pa_function *)function, dims, smem, stream, params, extra, paramsCount);
}

// ---------------------------------------------------------------- streams, events

// Distinct non-NULL addresses: callers may compare or store them.
static char g_stream_token, g_event_token;
EXPORT void *mgpuStreamCreate(void) { return &g_stream_token; }
EXPORT void mgpuStreamDestroy(void *stream) { (void)stream; }
EXPORT void mgpuStreamSynchronize(void *stream) { (void)stream; }
EXPORT void mgpuStreamWaitEvent(void *stream, void *event) { (void)stream; (void)event; }
EXPORT void *mgpuEventCreate(void) { return &g_event_token; }
EXPORT void mgpuEventDestroy(void *event) { (void)event; }
EXPORT void mgpuEventSynchronize(void *event) { (void)event; }
EXPORT void mgpuEventRecord(void *event, void *stream) { (void)event; (void)stream; }

// ---------------------------------------------------------------- memory

// Live mgpuMemAlloc blocks, so the emulator's sanitizer can allow them too.
typedef struct pa_alloc {
  void *base;
  uint64_t size;
  struct pa_alloc *next;
} pa_alloc;
static pa_alloc *g_allocs;

EXPORT void *mgpuMemAlloc(uint64_t sizeBytes, void *stream, bool isHostShared) {
  (void)stream; (void)isHostShared;
  void *p = NULL;
  // 256-byte alignment: what hipMalloc guarantees and buffer descriptors assume.
  if (posix_memalign(&p, 256, sizeBytes ? sizeBytes : 1) != 0)
    return NULL;
  pa_alloc *a = (pa_alloc *)malloc(sizeof(*a));
  if (a) {
    pthread_mutex_lock(&g_lock);
    a->base = p;
    a->size = sizeBytes;
    a->next = g_allocs;
    g_allocs = a;
    pthread_mutex_unlock(&g_lock);
  }
  return p;
}

EXPORT void mgpuMemFree(void *ptr, void *stream) {
  (void)stream;
  pthread_mutex_lock(&g_lock);
  for (pa_alloc **pp = &g_allocs; *pp; pp = &(*pp)->next) {
    if ((*pp)->base == ptr) {
      pa_alloc *dead = *pp;
      *pp = dead->next;
      free(dead);
      break;
    }
  }
  pthread_mutex_unlock(&g_lock);
  free(ptr);
}

// Copies up to `cap` live allocations into the arrays; returns how many exist.
EXPORT uint64_t pa_emu_allocations(uint64_t *bases, uint64_t *sizes, uint64_t cap) {
  uint64_t n = 0;
  pthread_mutex_lock(&g_lock);
  for (pa_alloc *a = g_allocs; a; a = a->next, ++n) {
    if (n < cap) {
      bases[n] = (uint64_t)(uintptr_t)a->base;
      sizes[n] = a->size;
    }
  }
  pthread_mutex_unlock(&g_lock);
  return n;
}

EXPORT void mgpuMemcpy(void *dst, void *src, size_t sizeBytes, void *stream) {
  (void)stream;
  memmove(dst, src, sizeBytes);
}

EXPORT void mgpuMemset32(void *dst, int value, size_t count, void *stream) {
  (void)stream;
  uint32_t *d = (uint32_t *)dst;
  for (size_t i = 0; i < count; ++i)
    d[i] = (uint32_t)value;
}

EXPORT void mgpuMemset16(void *dst, int shortValue, size_t count, void *stream) {
  (void)stream;
  uint16_t *d = (uint16_t *)dst;
  for (size_t i = 0; i < count; ++i)
    d[i] = (uint16_t)shortValue;
}

// Host memory is already "device" memory: registration is a no-op.
EXPORT void mgpuMemHostRegister(void *ptr, uint64_t sizeBytes) { (void)ptr; (void)sizeBytes; }
EXPORT void mgpuMemHostRegisterMemRef(int64_t rank, void *descriptor, int64_t elementSizeBytes) {
  (void)rank; (void)descriptor; (void)elementSizeBytes;
}
EXPORT void mgpuMemHostUnregister(void *ptr) { (void)ptr; }
EXPORT void mgpuMemHostUnregisterMemRef(int64_t rank, void *descriptor, int64_t elementSizeBytes) {
  (void)rank; (void)descriptor; (void)elementSizeBytes;
}

// MLIR's StridedMemRefType<T, 1>, returned by value; the device view of a host
// pointer is the pointer itself.
typedef struct {
  void *allocated;
  void *aligned;
  int64_t offset;
  int64_t sizes[1];
  int64_t strides[1];
} pa_memref1d;

static pa_memref1d device_memref(void *aligned, int64_t offset, int64_t size, int64_t stride) {
  pa_memref1d r = {aligned, aligned, offset, {size}, {stride}};
  return r;
}

EXPORT pa_memref1d mgpuMemGetDeviceMemRef1dFloat(float *allocated, float *aligned, int64_t offset,
                                                 int64_t size, int64_t stride) {
  (void)allocated;
  return device_memref(aligned, offset, size, stride);
}

EXPORT pa_memref1d mgpuMemGetDeviceMemRef1dInt32(int32_t *allocated, int32_t *aligned,
                                                 int64_t offset, int64_t size, int64_t stride) {
  (void)allocated;
  return device_memref(aligned, offset, size, stride);
}

EXPORT void mgpuSetDefaultDevice(int32_t device) { (void)device; }

// ktrace buffers (flydsl.runtime.device_runtime.rocm_ktrace_buffer) live in host
// memory here, so clearing and reading them are plain memory operations.
EXPORT int mgpuTraceBufferClear(void *ptr, uint64_t sizeBytes) {
  memset(ptr, 0, sizeBytes);
  return 0;
}

EXPORT int mgpuTraceBufferRead(void *dst, void *src, uint64_t sizeBytes) {
  memcpy(dst, src, sizeBytes);
  return 0;
}
