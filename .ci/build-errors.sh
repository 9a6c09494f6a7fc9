# Sourced by .ci/setup and .ci/gpu-check.
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
