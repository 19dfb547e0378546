#!/usr/bin/env bash
# jaxflow on a Cloud TPU VM pod slice: one process per TPU VM host, started on every worker at
# once; jax.distributed finds its peers from the TPU metadata (--distributed-auto).
#
#   bash docs/launch/tpu_pod.sh            # from a machine with gcloud, after EDIT 1 and EDIT 2
#
# Prerequisite (once): a slice, e.g.
#   gcloud compute tpus tpu-vm create "$TPU" --zone="$ZONE" --accelerator-type=v5p-128 \
#     --version=v2-alpha-tpuv5
set -euo pipefail

# ---- EDIT 1: where the slice is -------------------------------------------------------------
TPU=my-v5p-slice
ZONE=us-east5-a
PROJECT=my-project

# ---- EDIT 2: what to run and where its run directory lives (must be shared: gs:// or NFS) ---
RUN="python -m jaxflow.run --exp=lm_pretrain --variant=full --distributed-auto --out=gs://my-bucket/runs/lm-full --secret-file=../.jaxflow-job-secret"
# The job secret (jaxflow.job_auth): the job's sockets answer only processes holding it. Made
# here once, copied to every worker's home (the command runs in ~/jaxflow); copy the same file
# to the workers of a second job that must talk to this one (the flagship's rollout job).
SECRET_FILE=.jaxflow-job-secret

REPO=https://github.com/jaxflow/jaxflow.git  # or scp a checkout to every worker
SETUP="test -d jaxflow || git clone $REPO jaxflow; cd jaxflow && python3 -m pip install -q -e . 'jax[tpu]>=0.10.2,<0.12'"

# Every worker runs the same command; process 0 writes config.json / metrics.jsonl / summary.json,
# all of them write the checkpoint (orbax, collectively). To continue a stopped run, set RUN to
#   python -m jaxflow.run --resume --out=gs://my-bucket/runs/lm-full --distributed-auto
test -f "$SECRET_FILE" || (umask 077; python3 -c "import secrets; print(secrets.token_hex(32))" > "$SECRET_FILE")
gcloud compute tpus tpu-vm scp "$SECRET_FILE" "$TPU":"$SECRET_FILE" --zone="$ZONE" --project="$PROJECT" --worker=all
gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --project="$PROJECT" --worker=all \
  --command="chmod 600 $SECRET_FILE && $SETUP && cd jaxflow && $RUN"
