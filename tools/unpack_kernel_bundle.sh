# Sourced by tools/gpu_suite.sh, tools/gpu_bench.sh, lab/gpu_perf.sh and lab/gpu_bwd_traffic.sh after FLASHSINK_CACHE_DIR is set: a kernel
# cache built on a machine without a GPU (`flashsink precompile ... --bundle`, tools/gpu_kernels.py) and carried as
# .fscache.tar.xz is unpacked once into an empty cache. Each entry is verified (key, sha256 of every
# file) and loaded when first used; one this machine cannot load is rebuilt here, so the bundle can
# only save compile time. `flashsink precompile` then reports the entries it found as "cached".
# The archive may hold the cache's contents (kernels/...) or the cache folder itself (.fscache/kernels/...,
# what `tar -cJf .fscache.tar.xz .fscache` makes): the folder's name is stripped. 2026-12-05: a bundle of the
# second kind unpacked into .fscache/.fscache, the suite found none of its kernels and compiled them all on
# the device (a whole call's time), so an unpack that finds no kernels now says so loudly.
if [ -f .fscache.tar.xz ] && [ ! -d "$FLASHSINK_CACHE_DIR/kernels" ]; then
  _fs_strip=0
  case "$(tar -tJf .fscache.tar.xz | grep -m 1 '/kernels/')" in
    kernels/*|./kernels/*) _fs_strip=0 ;;
    */kernels/*) _fs_strip=1 ;;
  esac
  mkdir -p "$FLASHSINK_CACHE_DIR" && chmod 700 "$FLASHSINK_CACHE_DIR" \
    && tar -xJf .fscache.tar.xz -C "$FLASHSINK_CACHE_DIR" --strip-components="$_fs_strip"
  _fs_n=$(ls "$FLASHSINK_CACHE_DIR/kernels" 2>/dev/null | wc -l)
  if [ "$_fs_n" -gt 0 ]; then
    echo "kernel bundle: $_fs_n entries unpacked into $FLASHSINK_CACHE_DIR"
  else
    echo "kernel bundle: WARNING: .fscache.tar.xz put no kernels into $FLASHSINK_CACHE_DIR/kernels (its layout:" \
      "$(tar -tJf .fscache.tar.xz | head -n 2 | tr '\n' ' ')); every kernel will be compiled here" >&2
  fi
  unset _fs_strip _fs_n
fi
