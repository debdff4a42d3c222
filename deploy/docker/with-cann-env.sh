#!/bin/bash
# Runs a command with the Ascend CANN environment loaded (the NPU image's
# wrapper; installed as /opt/npu-gateway/bin/with-cann-env).
#
# The CANN base image under quay.io/ascend/vllm-ascend sets most variables
# with ENV, and its ENTRYPOINT sources three scripts: the toolkit's
# set_env.sh, the ascendnpu-ir set_env.sh (puts bishengir-compile on PATH,
# which triton-ascend needs: vllm-ascend runs RoPE through a Triton kernel)
# and NNAL's (libatb) with --cxx_abi=${ATB_CXX_ABI:-1}. Our Dockerfile
# replaces that ENTRYPOINT, and `docker exec`, a Kubernetes `command` or a
# Ray worker never run it, so `npu-gateway` in the NPU image is a two-line
# script that execs this one, which sources the same three, and Ray workers
# start with `with-cann-env ray start ...` (deploy/ray/README.md).
#
# Each script is sourced with errors tolerated: they reference unset
# variables and some return non-zero on success paths (vllm-ascend's own CI
# wraps NNAL's in `set +eu`). A missing one is named on stderr, not fatal.
# ASCEND_ROOT (default /usr/local/Ascend) exists for tests.
ascend_root="${ASCEND_ROOT:-/usr/local/Ascend}"

cann_source() {  # FILE [ARG...]: source FILE, whatever it returns
    local f="$1"
    shift
    if [ -f "$f" ]; then
        # shellcheck disable=SC1090
        source "$f" "$@" || echo "with-cann-env: $f returned $? (continuing)" >&2
        set +eu  # a script that turned these on must not end the wrapper on the next one's error
    else
        echo "with-cann-env: $f not found; is this the vllm-ascend image?" >&2
    fi
}

cann_source "${ascend_root}/ascend-toolkit/set_env.sh"
# The CANN directory is versioned (cann-9.1.0, or a date in daily images).
cann_dir=""
for d in "${ascend_root}"/cann-*; do
    [ -d "$d" ] && cann_dir="$d" && break
done
if [ -n "$cann_dir" ]; then
    cann_source "${cann_dir}/share/info/ascendnpu-ir/bin/set_env.sh"
else
    echo "with-cann-env: no ${ascend_root}/cann-* directory; bishengir-compile may be missing" >&2
fi
cann_source "${ascend_root}/nnal/atb/set_env.sh" --cxx_abi="${ATB_CXX_ABI:-1}"

# The driver's user-space libraries are mounted from the host at run time
# (see deploy/README.md).
export LD_LIBRARY_PATH="${ascend_root}/driver/lib64/common:${ascend_root}/driver/lib64/driver${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"

if [ "$#" -eq 0 ]; then
    echo "usage: with-cann-env COMMAND [ARG...]" >&2
    exit 64
fi
exec "$@"
