# Sourced by the .ci scripts that work in a folder or on a file that someone else could have put
# in place: setup and wheel (the wheel cache), gpu-check (its build folder), distro-check (its work
# folder, as root), horovod-patch (an sdist), horovod-suite and horovod-examples (their output
# folders, when given), slurm (its cluster folder, as root).  What such a folder holds is run,
# installed or written through as whoever runs the script: a folder another user made first, or
# can write to, would let them choose what that is.  Needs bash, stat, sha256sum, cut, sed, id.

# private_dir DIR: make DIR where it is missing (umask 077, as every folder above it that is
# missing) and succeed only where it is a folder, not a symlink, owned by the caller and writable
# by no one else (neither group nor others).  Otherwise print why, as words that start with DIR,
# and fail.  A folder that exists is never changed, nor anything in it.
private_dir() {
  local d=$1 owner mode
  if [ ! -e "$d" ] && [ ! -L "$d" ]; then
    (umask 077 && mkdir -p -- "$d") 2>/dev/null || { echo "$d cannot be created"; return 1; }
  fi
  if [ -L "$d" ]; then echo "$d is a symlink"; return 1; fi
  if [ ! -d "$d" ]; then echo "$d is not a folder"; return 1; fi
  if [ ! -O "$d" ]; then
    owner=$(stat -c %U -- "$d" 2>/dev/null) || owner="someone else"
    echo "$d belongs to $owner, not to you ($(id -un 2>/dev/null || id -u))"; return 1
  fi
  mode=$(stat -c %a -- "$d" 2>/dev/null) || { echo "$d cannot be read"; return 1; }
  if (( (8#$mode & 8#022) != 0 )); then echo "$d is writable by others (mode $mode)"; return 1; fi
}

# own_file FILE: succeed where FILE is absent, or a regular file, not a symlink, owned by the
# caller; otherwise print why (words that start with FILE) and fail.  For a file in a folder that
# passed private_dir (no one else can put one there since), before it is read, written or appended to.
own_file() {
  local f=$1 owner
  if [ -L "$f" ]; then echo "$f is a symlink"; return 1; fi
  [ -e "$f" ] || return 0
  if [ ! -f "$f" ]; then echo "$f is not a regular file"; return 1; fi
  if [ ! -O "$f" ]; then
    owner=$(stat -c %U -- "$f" 2>/dev/null) || owner="someone else"
    echo "$f belongs to $owner, not to you"; return 1
  fi
}

# sdist_pinned VERSION: the sha256 pinned for horovod-VERSION.tar.gz in .ci/horovod-sdist.sha256
# (sha256sum's format; lines starting with # are comments), or nothing where none is.
sdist_pinned() {
  local pins
  pins=$(dirname "${BASH_SOURCE[0]}")/horovod-sdist.sha256
  sed -n "s/^\([0-9a-f]\{64\}\)  horovod-${1//./\\.}\.tar\.gz\$/\1/p" "$pins" 2>/dev/null | sed -n 1p
}

# verify_sdist FILE VERSION: succeed where FILE is a regular file with the sha256 pinned for
# horovod-VERSION.tar.gz; otherwise print why (words that start with FILE) and fail.  Check a copy
# in a folder of yours, and unpack that copy: a file elsewhere could change after the check.
verify_sdist() {
  local file=$1 version=$2 want got
  want=$(sdist_pinned "$version")
  if [ -z "$want" ]; then
    echo "$file: no sha256 is pinned for horovod-$version.tar.gz in .ci/horovod-sdist.sha256"; return 1
  fi
  if [ ! -f "$file" ]; then echo "$file is not a regular file"; return 1; fi
  got=$(sha256sum < "$file" | cut -d' ' -f1) || { echo "$file cannot be read"; return 1; }
  if [ "$got" != "$want" ]; then
    echo "$file has sha256 $got, not the $want pinned for horovod-$version.tar.gz (.ci/horovod-sdist.sha256)"
    return 1
  fi
}
