# The GEMV's one-block rows without the loop (ONE_STEP) against the build before it (BASE: a copy of that
# package, carried), both with the norms folded; processes alternate in one start.
cd "$(dirname "$0")/../../.."
r=$OUT/one-step; mkdir -p $r
export PYTHONUNBUFFERED=1
S=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
left() { [ $(( $(date +%s) - S + T )) -lt ${LIMIT:-420} ]; }
ab() { left || { echo "skip $*"; return; }
  local build=$1; shift
  PYTHONPATH=$([ $build = base ] && echo $BASE || echo .) timeout $T python3 scripts/experiments/fold-norms/ab.py "$@" \
    | sed "s/^{/{\"build\": \"$build\", /" >> $r/rates.jsonl 2>>$r/rates.err; tail -n 1 $r/rates.err; }
T=45 ab base llama3-1b 1 3 folded
T=45 ab one-step llama3-1b 1 3 folded
T=45 ab base llama3-1b 1 3 folded
T=45 ab one-step llama3-1b 1 3 folded
T=75 ab one-step llama3-8b 1 3 folded
T=75 ab base llama3-8b 1 3 folded
echo elapsed $(( $(date +%s) - S ))
python3 -c "
import json
for l in open('$r/rates.jsonl'):
    d=json.loads(l); print(d['build'],d['preset'],d['variant'],d['median'],d['rates'],d['same_tokens'])"
