#!/bin/bash
# flagship quick: one job (1 device, roles colocated) vs trainer job (1 device) + rollout job (1 device)
cd "$(dirname "$0")/../.."
R=${1:-runs/flagship_two_jobs}; rm -rf $R; mkdir -p $R
C="--set cache_root=$R/cache"
python -m jaxflow.run --exp=flagship --variant=quick --devices=1 --set devices=1 $C --out=$R/single > $R/single.log 2>&1
echo "single rc=$?" >> $R/status
PORT=47555
python -m jaxflow.job_auth $R/job.secret > /dev/null  # the two jobs' sockets answer only its holders
S="--secret-file=$R/job.secret"
python -m jaxflow.run --exp=flagship --variant=quick --devices=1 $C $S --set remote.role=rollout --set remote.listen=127.0.0.1:$PORT --out=$R/rollout > $R/rollout.log 2>&1 &
python -m jaxflow.run --exp=flagship --variant=quick --devices=1 $C $S --set remote.role=trainer --set remote.rollout=127.0.0.1:$PORT --out=$R/trainer > $R/trainer.log 2>&1
echo "trainer rc=$?" >> $R/status
wait
echo "rollout rc=$?" >> $R/status
