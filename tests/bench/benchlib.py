"""What the benchmark scripts share: how many GPUs there are, the environment the PyTorch peers run
in, and the text every Debian system has to train on."""
import os, subprocess


def gpus():
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES, else what nvidia-smi lists; 0 without it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return out.count("GPU ")
    except (OSError, subprocess.SubprocessError):
        return 0


def peer_env():
    """The environment for PyTorch: the host's own libraries, not the ones unpacked for building ltrain
    (deploy/gpu-env.sh keeps the host's LD_LIBRARY_PATH in LTRAIN_HOST_LD_LIBRARY_PATH)."""
    env = dict(os.environ)
    if "LTRAIN_HOST_LD_LIBRARY_PATH" in env:
        env["LD_LIBRARY_PATH"] = env["LTRAIN_HOST_LD_LIBRARY_PATH"]
    return env


def licence_texts():
    """The licence texts of /usr/share/common-licenses (package base-files), sorted."""
    root = "/usr/share/common-licenses"
    return sorted(os.path.join(root, f) for f in os.listdir(root))
