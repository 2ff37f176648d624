#!/usr/bin/env bash
# `npm start`: set-up if needed, train the demo GPT on Moby-Dick on 2 local ranks (the 512-id BPE
# of examples/gpt-tiny.toml; a new run directory each time, checkpoints every 100 steps), then sample
# a paragraph from the model it just trained (decoded with the run's tokenizer) and refresh the run's
# report with it. Extra arguments go to `flotilla train`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/ensure.sh
name="gpt-tiny-$(date +%Y%m%d-%H%M%S)"
flotilla() { node bin/flotilla.js "$@"; } # the compiled dist/ that ensure.sh just brought up to date
flotilla train examples/gpt-tiny.toml --nproc 2 --train.name="$name" "$@"
prompt='Call me Ishmael. '
echo "[sample] flotilla generate runs/$name --prompt '$prompt' --tokens 300 --seed 1"
flotilla generate "runs/$name" --prompt "$prompt" --tokens 300 --seed 1 --out "runs/$name/sample.txt"
flotilla report "runs/$name"
