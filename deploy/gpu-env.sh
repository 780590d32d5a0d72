# Source on a GPU host that has PyTorch (LibTorch, CUDA, NCCL) but not the control plane's libraries:
#   deploy/gpu-deps.sh .deps/debs                     (on a Debian 12 machine; carry .deps to the host)
#   source deploy/gpu-env.sh                          (unpacks .deps/debs into /opt/deps once)
#   cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$LTRAIN_GPU_PREFIX" && cmake --build build-gpu
# The Debian packages are never unpacked into /: the host's own libraries stay as they are.
if [ ! -d /opt/deps/usr ]; then
  mkdir -p /opt/deps
  for f in .deps/debs/*.deb; do dpkg -x "$f" /opt/deps; done
fi
export TORCH_CMAKE=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
export NCCL_HOME=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.dirname(n.__file__) if n.__file__ else list(n.__path__)[0])' 2>/dev/null)
export LTRAIN_GPU_PREFIX="$TORCH_CMAKE;/opt/deps/usr"
# PyTorch itself (the peer benchmarks) runs with the host's own libraries.
export LTRAIN_HOST_LD_LIBRARY_PATH=${LTRAIN_HOST_LD_LIBRARY_PATH-${LD_LIBRARY_PATH:-}}
export LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu:/opt/deps/usr/lib:${NCCL_HOME:+$NCCL_HOME/lib:}${LD_LIBRARY_PATH:-}
export LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu:/opt/deps/usr/lib
export PATH=/opt/deps/usr/bin:$PATH
# NVLink multicast stays off wherever NCCL starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
