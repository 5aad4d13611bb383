#!/usr/bin/env bash
# Creates the LeRobot peer benchmark's own virtual environment (outside the repo, outside CI):
#   bash benchmarks/lerobot_env.sh            # -> /work/venvs/lerobot (override with LEROBOT_VENV)
# LeRobot 0.4.4 pins torch<2.11. A CPU torch of that line comes from PyTorch's CPU wheel index
# when that host is reachable; the package registry's x86_64 torch wheels are the CUDA builds
# (they pull the nvidia-* packages, several GB), so they are refused. Failing both, the newest
# CPU torch at hand (a local wheel in $PIP_FIND_LINKS, or the registry's when it is a CPU
# build) is used and LeRobot is installed without its torch pin, which this script says.
set -euo pipefail
VENV=${LEROBOT_VENV:-/work/venvs/lerobot}
LEROBOT_VER=${LEROBOT_VER:-0.4.4}
TORCH_VER=${TORCH_VER:-2.10.0}
TV_VER=${TV_VER:-0.25.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu
# The machine-wide pip constraints cap torch for the main environment, not this one.
export PIP_CONSTRAINT=

python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)
"${PIP[@]}" -U pip wheel

is_cpu_build() {  # $1: requirement; true when pip would install no nvidia-* package with it
  local report
  report=$(mktemp)
  "$VENV/bin/pip" install -q --dry-run --ignore-installed --report "$report" "$@" >/dev/null 2>&1 || return 1
  ! grep -q '"name": "nvidia-' "$report"
}

if "${PIP[@]}" "torch==$TORCH_VER" "torchvision==$TV_VER" --index-url "$CPU_INDEX" 2>/dev/null; then
  echo "torch $TORCH_VER (CPU) from $CPU_INDEX"
elif is_cpu_build "torch==$TORCH_VER"; then
  "${PIP[@]}" "torch==$TORCH_VER" "torchvision==$TV_VER"
  echo "torch $TORCH_VER from the registry (a CPU build)"
else
  # the newest torch wheel built for CPU ("+cpu" local version) in pip's find-links folders
  CPU_TORCH=$(for d in ${PIP_FIND_LINKS:-}; do ls "$d"/torch-*+cpu-*.whl 2>/dev/null; done | sort -V | tail -1)
  if [ -z "$CPU_TORCH" ]; then
    echo "no CPU torch: $CPU_INDEX is unreachable, the registry's torch==$TORCH_VER is a CUDA build" \
      "and no torch-*+cpu wheel lies in PIP_FIND_LINKS (${PIP_FIND_LINKS:-unset}): giving up" >&2
    exit 1
  fi
  echo "NOTE: no CPU torch==$TORCH_VER: $CPU_INDEX is unreachable and the registry's is a CUDA build" \
    "(it pulls the nvidia-* packages); using $CPU_TORCH instead, so LeRobot's torch<2.11 pin is not met" >&2
  "${PIP[@]}" "$CPU_TORCH"
  # The registry's torchvision (and torchcodec) x86_64 wheels are CUDA builds: their compiled
  # ops link libtorch_cuda.so and do not load beside a CPU torch, and torchvision's import then
  # fails registering fake kernels for the missing ops ("operator torchvision::nms does not
  # exist"). LeRobot's dataset code uses only torchvision's Python parts (transforms, and
  # io.VideoReader on PyAV, its decoder when torchcodec is absent), so install it without its
  # torch pin and register those fake kernels only when the ops loaded. torchcodec is left
  # out: every version from the registry links CUDA libraries, so LeRobot decodes with PyAV.
  "${PIP[@]}" --no-deps "torchvision==$TV_VER"
  sed -i -E 's/^@torch\.library\.register_fake\(("torchvision::[a-z]+")\)$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))/' \
    "$("$VENV/bin/python" -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')/_meta_registrations.py"
fi
TORCH_INSTALLED=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
echo "torch in $VENV: $TORCH_INSTALLED"

# LeRobot without its torch/torchvision/torchcodec pins, then its other requirements.
"${PIP[@]}" --no-deps "lerobot==$LEROBOT_VER"
"$VENV/bin/python" - "$LEROBOT_VER" >"$VENV/lerobot-reqs.txt" <<'PY'
import importlib.metadata as md
for req in md.requires("lerobot") or []:
    name = req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower()
    if "extra ==" in req or name in {"torch", "torchvision", "torchcodec"}:
        continue
    print(req)
PY
"${PIP[@]}" -r "$VENV/lerobot-reqs.txt"
"$VENV/bin/python" -W ignore -c 'from lerobot.datasets.lerobot_dataset import LeRobotDataset' && echo "LeRobotDataset imports"
echo "installed: $("$VENV/bin/pip" list 2>/dev/null | grep -iE '^(lerobot|torch|torchvision|torchcodec|av) ' | tr -s ' ' | paste -sd, -)"
