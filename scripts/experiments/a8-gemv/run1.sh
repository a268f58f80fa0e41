set -x
mkdir -p /tmp/r; cd "$(dirname "$0")/.."
save() { tar czf $OUT/run.tgz -C /tmp r; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > /tmp/r/gpu.txt; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" >> /tmp/r/gpu.txt
for v in main cnt main cnt; do
  d=$PWD/diag/head; [ $v = cnt ] && d=$PWD/diag/cnt
  PYTHONPATH=$d timeout 90 python3 diag/rate.py llama3-8b int4 1 3 int4-$v >> /tmp/r/ab.jsonl 2>>/tmp/r/ab.err; save
done
for v in main late main late; do
  d=$PWD/diag/head; [ $v = late ] && d=$PWD/diag/late
  PYTHONPATH=$d timeout 80 python3 diag/rate.py llama3-8b bf16 1 3 bf16-$v >> /tmp/r/ab.jsonl 2>>/tmp/r/ab.err; save
done
NCU=$(which ncu || ls /usr/local/cuda*/bin/ncu | head -1)
PYTHONPATH=$PWD/diag/head timeout 170 $NCU --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section InstructionStats -o /tmp/r/prof python3 diag/ncu_kern.py > /tmp/r/ncu.log 2>&1
$NCU --import /tmp/r/prof.ncu-rep --page details --csv > /tmp/r/details.csv 2>>/tmp/r/ncu.log
$NCU --import /tmp/r/prof.ncu-rep --page raw --csv --metrics smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__average_warp_latency_issue_stalled_long_scoreboard > /tmp/r/raw.csv 2>>/tmp/r/ncu.log
rm -f /tmp/r/prof.ncu-rep.bak; save
cat /tmp/r/ab.jsonl; tail -5 /tmp/r/ab.err; tail -20 /tmp/r/ncu.log
