# Sourced first by every device call: installs the carried wheels into the image's Python (ferrox's
# `ferrox` script included), prints what the machine is.
python3 -m pip install -q --no-deps --no-index --force-reinstall .gpu-wheels/*.whl 2>&1 | grep -v "^WARNING\|already" | tail -3
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, ferrox._core; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
