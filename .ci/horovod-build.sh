# Sourced by .ci/setup and .ci/gpu-check, the two scripts that build Horovod.

# patch_horovod SRC PATCH: apply our patch to Horovod's unpacked sdist in SRC, and record in the
# package which patch that was (horovod/_ringtrain_patch.py, inside the wheel): setup checks a
# cached wheel against it, and the trainers refuse a Horovod built from another patch
# (launch/dispatch.py), so a stale build never runs without the fixes the checkout expects.
patch_horovod() {
  local src=$1 patch_file=$2
  if command -v patch >/dev/null; then
    patch -d "$src" -p1 --quiet < "$patch_file" || return 1
  else
    (cd "$src" && git apply -p1) < "$patch_file" || return 1
  fi
  printf '"""The ringtrain patch this Horovod was built from (written by .ci/horovod-build.sh)."""\nPATCH_SHA256 = "%s"\n' \
    "$(sha256sum "$patch_file" | cut -d' ' -f1)" > "$src/horovod/_ringtrain_patch.py"
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
