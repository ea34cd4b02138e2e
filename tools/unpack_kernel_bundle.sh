# Sourced by tools/gpu_suite.sh, gpu_bench.sh and gpu_perf.sh after FLASHSINK_CACHE_DIR is set: a kernel
# cache built on a machine without a GPU (tools/precompile_cpu_bundle.py) and carried as
# .fscache.tar.xz is unpacked once into an empty cache. Each entry is verified (key, sha256 of every
# file) and loaded when first used; one this machine cannot load is rebuilt here, so the bundle can
# only save compile time. `flashsink precompile` then reports the entries it found as "cached".
if [ -f .fscache.tar.xz ] && [ ! -d "$FLASHSINK_CACHE_DIR/kernels" ]; then
  mkdir -p "$FLASHSINK_CACHE_DIR" && chmod 700 "$FLASHSINK_CACHE_DIR" \
    && tar -xJf .fscache.tar.xz -C "$FLASHSINK_CACHE_DIR" \
    && echo "kernel bundle: $(ls "$FLASHSINK_CACHE_DIR/kernels" | wc -l) entries unpacked into $FLASHSINK_CACHE_DIR"
fi
