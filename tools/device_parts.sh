# Sourced, not run: a bundle that is larger than one device call may carry (64 MiB with the working
# tree), packed here into parts and joined there, on a machine that stays warm between calls.
#
#   here:   pack_parts WORK DEST LABEL [XZ_LEVEL]
#             WORK holds the folders to bundle (e.g. src/, wheels/); one tar, xz at XZ_LEVEL (default
#             -9e; 0 = plain tar, for content that is already compressed), split into parts of
#             PART_MIB (default DEFAULT_PART_MIB) MiB: DEST/part-<k>/ holds bundle.<k> and MANIFEST (LABEL, the
#             bundle's and every part's sha256, the part count, the format)
#   there:  stage_parts DEST ROOT
#             each carried DEST/part-<k> checked and kept in ROOT/parts (/tmp survives between calls
#             on a warm machine; carried folders do not); once every part is there: joined, checked,
#             unpacked into ROOT, ROOT/wheels/*.whl installed into ROOT/site, ROOT/ready stamped
#             with the bundle's hash. Returns 0 staged (now or before), 3 parts still to carry, 2 failed.
# Needs PYTHON (default python3) for the install.

manifest_field() { sed -n "s/^$1 //p" "$2" | head -1; }

# A part travels with the working tree in one call (64 MiB, as the device counts it: it refused a part of
# 58 MiB beside a 5.8 MiB tree that this script's count put at 63.8 MiB), so parts leave the tree room to grow.
DEFAULT_PART_MIB=50
# the warning's bound: 64 MiB less what the device's count has read above this script's
CALL_LIMIT_MIB=63

pack_parts() {
  local work=$1 dest=$2 label=$3 level=${4:--9e} part_mib=${PART_MIB:-$DEFAULT_PART_MIB} sha n k f tree sz
  local limit=$((CALL_LIMIT_MIB * 1024 * 1024))
  if [ "$level" = 0 ]; then
    tar cf "$work/bundle.tar" -C "$work" $(cd "$work" && ls -d */)
  else
    tar cf - -C "$work" $(cd "$work" && ls -d */) | xz "$level" -T0 -c >"$work/bundle.tar"
  fi
  rm -rf "$dest"; mkdir -p "$dest"
  sha=$(sha256sum "$work/bundle.tar" | cut -d' ' -f1)
  split -b "${part_mib}M" -d -a 1 "$work/bundle.tar" "$work/part."
  n=$(ls "$work"/part.* | wc -l)
  {
    echo "$label"
    echo "bundle $sha $(stat -c %s "$work/bundle.tar")"
    echo "parts $n"
    echo "format $([ "$level" = 0 ] && echo tar || echo xz)"
    k=1; for f in "$work"/part.*; do echo "part $k $(sha256sum "$f" | cut -d' ' -f1) $(stat -c %s "$f")"; k=$((k + 1)); done
    echo "wheels $(cd "$work/wheels" 2>/dev/null && ls | tr '\n' ' ')"
  } >"$work/MANIFEST"
  k=1
  for f in "$work"/part.*; do
    mkdir -p "$dest/part-$k"; mv "$f" "$dest/part-$k/bundle.$k"; cp "$work/MANIFEST" "$dest/part-$k/"; k=$((k + 1))
  done
  rm -f "$work/bundle.tar"
  sed 's/^wheels .*/wheels: see MANIFEST/' "$work/MANIFEST"
  # what else travels with a part: tracked files and untracked ones that git does not ignore
  tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
  for f in "$dest"/part-*; do
    sz=$(du -cb "$f" | tail -1 | cut -f1)
    if (( sz + tree > limit )); then
      echo "pack: WARNING: $f ($sz B) + working tree ($tree B) exceed the $CALL_LIMIT_MIB MiB one call can take: lower PART_MIB" >&2
    fi
  done
  echo "pack: $n parts in $dest (working tree $((tree / 1024 / 1024)) MiB beside each); carry one per call:"
}

stage_parts() {
  local dest=$1 root=$2 m="" d f k sha size n have=0 want_sha missing="" ready
  mkdir -p "$root/parts"
  ready=$(cat "$root/ready" 2>/dev/null)
  for d in "$dest"/part-*; do
    [ -f "$d/MANIFEST" ] || continue
    # a part of the bundle already unpacked (the warm machine keeps ignored folders too): nothing to check or keep
    [ "$(manifest_field bundle "$d/MANIFEST" | cut -d' ' -f1)" = "$ready" ] && continue
    m=$d/MANIFEST
    cp "$m" "$root/parts/MANIFEST"
    for f in "$d"/bundle.*; do
      k=${f##*.}
      want_sha=$(awk -v k="$k" '$1 == "part" && $2 == k {print $3}' "$m")
      sha=$(sha256sum "$f" | cut -d' ' -f1)
      if [ "$sha" != "$want_sha" ]; then echo "stage: part $k's sha256 differs from MANIFEST (a bad transfer?)"; return 2; fi
      cp "$f" "$root/parts/bundle.$k"
      echo "stage: part $k kept in $root/parts ($(stat -c %s "$f") bytes)"
    done
  done
  m=$root/parts/MANIFEST
  if [ ! -f "$m" ]; then echo "stage: no part carried and none kept: carry $dest/part-1"; return 2; fi
  n=$(manifest_field parts "$m")
  read -r want_sha size <<<"$(manifest_field bundle "$m")"
  if [ "$ready" = "$want_sha" ]; then echo "stage: $(head -1 "$m") already unpacked in $root"; return 0; fi
  for k in $(seq 1 "$n"); do
    if [ -f "$root/parts/bundle.$k" ]; then have=$((have + 1)); else missing="$missing $k"; fi
  done
  if [ -n "$missing" ]; then
    echo "stage: $have of $n parts here; still to carry (machine warm):$missing"; return 3
  fi
  echo "stage: all $n parts here: joining, checking, unpacking"
  cat $(for k in $(seq 1 "$n"); do echo "$root/parts/bundle.$k"; done) >"$root/bundle.tar"
  sha=$(sha256sum "$root/bundle.tar" | cut -d' ' -f1)
  if [ "$sha" != "$want_sha" ]; then echo "stage: the joined bundle's sha256 differs from MANIFEST"; return 2; fi
  rm -rf "$root/src" "$root/wheels" "$root/site"
  if [ "$(manifest_field format "$m")" = tar ]; then
    tar xf "$root/bundle.tar" -C "$root" || { echo "stage: unpacking FAILED"; return 2; }
  else  # xz (a MANIFEST without a format line too)
    xz -dc -T0 "$root/bundle.tar" | tar xf - -C "$root" || { echo "stage: unpacking FAILED"; return 2; }
  fi
  rm -f "$root/bundle.tar" "$root"/parts/bundle.*
  if ! "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$root/site" \
      "$root"/wheels/*.whl >"$root/pip.log" 2>&1; then
    echo "stage: installing the wheels FAILED:"; tail -5 "$root/pip.log"; return 2
  fi
  echo "$want_sha" >"$root/ready"
  echo "stage: $(head -1 "$m"): $(ls "$root"/wheels/*.whl | wc -l) wheels installed in $root/site"
}
