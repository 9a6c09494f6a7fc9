# Sourced by .ci/setup and .ci/gpu-check, the two scripts that build Horovod, and by .ci/wheel and
# .ci/horovod-patch.

# The patch series (.ci/horovod-patches/): one patch per change, applied in the order of its
# `series` file (one name a line; blank lines and lines starting with # are ignored), as Debian
# keeps a patched upstream.  .ci/horovod-patch turns it into a git tree and back.

# series_patches DIR: the series' patch names, in order.
series_patches() {
  sed -e 's/#.*//' -e 's/[[:space:]]*$//' -e '/^$/d' "$1/series"
}

# series_sha256 DIR: the series' hash, what a build records and its cache key names: the SHA-256
# of the lines `sha256sum` prints for the patches in series order ("<sha256>  <name>"), so it
# changes with any patch's content, name or place (ringtrain/horovod_build.py computes the same).
series_sha256() {
  local dir=$1 name lines=""
  while read -r name; do
    [ -f "$dir/$name" ] || { echo "the series names $name, which $dir lacks" >&2; return 1; }
    lines+="$(sha256sum < "$dir/$name" | cut -d' ' -f1)  $name"$'\n'
  done < <(series_patches "$dir")
  printf '%s' "$lines" | sha256sum | cut -d' ' -f1
}

# patch_horovod SRC SERIES_DIR: apply the series to Horovod's unpacked sdist in SRC, each patch
# exactly (no fuzz), and record in the package which series that was (horovod/_ringtrain_patch.py,
# inside the wheel): setup checks a cached wheel against it, and the trainers refuse a Horovod
# built from another series (ringtrain/horovod_build.py), so a stale build never runs without the fixes
# the checkout expects.  The package's version says it too: 0.28.1+ringtrain.<series hash, 10
# hex digits> (a PEP 440 local version: pip and `horovod.__version__` agree, and `==0.28.1`
# still matches it).
patch_horovod() {
  local src=$1 dir=$2 name sum
  sum=$(series_sha256 "$dir") || return 1
  while read -r name; do
    if command -v patch >/dev/null; then
      patch -d "$src" -p1 --quiet --fuzz=0 --no-backup-if-mismatch < "$dir/$name" ||
        { echo "$name does not apply" >&2; return 1; }
    else
      (cd "$src" && git apply -p1) < "$dir/$name" || { echo "$name does not apply" >&2; return 1; }
    fi
  done < <(series_patches "$dir")
  printf '"""The ringtrain patch series this Horovod was built from (written by .ci/horovod-build.sh)."""\nPATCH_SHA256 = "%s"\n' \
    "$sum" > "$src/horovod/_ringtrain_patch.py"
  sed -i "s/^__version__ = '\([0-9.]*\)'\$/__version__ = '\1+ringtrain.${sum:0:10}'/" "$src/horovod/__init__.py"
  grep -q "^__version__ = '[0-9.]*+ringtrain.${sum:0:10}'\$" "$src/horovod/__init__.py" ||
    { echo "cannot set the version in $src/horovod/__init__.py" >&2; return 1; }
}

# horovod_build_key PY SERIES_DIR VERSION: the cache key of the Horovod wheel that PY's environment
# builds, in BUILD_KEY: everything the build is bound to (Python, torch and TensorFlow versions,
# machine, MPI, compiler, GPU operations) and the series and this recipe, comments aside (a wheel
# of an older recipe lacks what the recipe records now).  Also sets BUILD_PYTHON, BUILD_TORCH,
# BUILD_TF, BUILD_MACHINE, BUILD_MPI, BUILD_GCC, BUILD_GPU for callers that print them.
horovod_build_key() {
  local py=$1 dir=$2 version=$3 frameworks series sum
  frameworks=$(TF_CPP_MIN_LOG_LEVEL=3 "$py" - 2>/dev/null <<'EOF'
import platform, sys
import torch, tensorflow as tf
print(f"{sys.version_info.major}.{sys.version_info.minor}", torch.__version__, tf.__version__,
      platform.machine())
EOF
) || return 1
  read -r BUILD_PYTHON BUILD_TORCH BUILD_TF BUILD_MACHINE <<<"$frameworks"
  # (sed, not head: under pipefail a writer cut off by head dies of SIGPIPE and takes setup with it)
  BUILD_MPI=$(mpirun --version 2>/dev/null | sed -n 1p | tr -cs 'A-Za-z0-9.' '-' | sed 's/-$//')
  BUILD_GCC=$(g++ -dumpfullversion 2>/dev/null || g++ -dumpversion)
  BUILD_GPU=${HOROVOD_GPU_OPERATIONS:-cpu}
  series=$(series_sha256 "$dir") || return 1
  sum=$({ echo "$series"; grep -v '^[[:space:]]*#' "${BASH_SOURCE[0]}"; } | sha256sum | cut -c1-10)
  BUILD_KEY="horovod${version}-py${BUILD_PYTHON}-torch${BUILD_TORCH}-tf${BUILD_TF}-${BUILD_MACHINE}"
  BUILD_KEY+="-${BUILD_MPI}-gcc${BUILD_GCC}-${BUILD_GPU}-patch${sum}"
}

# wheel_patch WHEEL PYTHON: the PATCH_SHA256 a Horovod wheel records ("" if none).
wheel_patch() {
  "$2" - "$1" <<'PY'
import re, sys, zipfile
try:
    text = zipfile.ZipFile(sys.argv[1]).read("horovod/_ringtrain_patch.py").decode()
except (KeyError, OSError, zipfile.BadZipFile):
    text = ""
m = re.search(r'PATCH_SHA256 = "([0-9a-f]+)"', text)
print(m.group(1) if m else "")
PY
}

# The first real error in a failed build log, with the lines that explain it: a compiler error
# (file:line: error:), else a CMake error, else a linker error, else the log's last lines.  One awk
# reads the whole file, so nothing in a pipe can die of SIGPIPE under pipefail.
first_build_error() {
  awk '
    function grab(kind, n) { if (!(kind in at)) { at[kind] = NR; want[kind] = n } }
    { line[NR] = $0 }
    /^[[:space:]]*[^[:space:]]+:[0-9]+:([0-9]+:)? (fatal )?error:/ { grab("cc", 3) }
    /^CMake Error/ { grab("cmake", 6) }
    /undefined reference to|collect2: error|^\/usr\/bin\/ld: .*cannot find/ { grab("ld", 1) }
    END {
      split("cc cmake ld", order, " ")
      for (i = 1; i <= 3; i++) {
        k = order[i]
        if (k in at) { for (j = at[k]; j <= at[k] + want[k] && j <= NR; j++) print line[j]; exit }
      }
      for (j = (NR > 15 ? NR - 15 : 1); j <= NR; j++) print line[j]
    }' "$1"
}
