#!/bin/bash
# Runs a command with the Ascend CANN environment loaded (the NPU image's
# wrapper; installed as /opt/npu-gateway/bin/with-cann-env).
#
# The vllm-ascend base image only sources these files from root's ~/.bashrc,
# which an exec-form ENTRYPOINT, `docker exec` or a Kubernetes `command` never
# reads, and never for a non-root user. So `npu-gateway` in the NPU image is a
# two-line script that execs this one, and Ray workers start with
# `with-cann-env ray start ...` (deploy/ray/README.md).
#
# The set_env.sh scripts reference unset variables: no `set -u` here.
set -e

for f in \
    /usr/local/Ascend/ascend-toolkit/set_env.sh \
    /usr/local/Ascend/nnal/atb/set_env.sh; do
    if [ -f "$f" ]; then
        # shellcheck disable=SC1090
        source "$f"
    else
        echo "with-cann-env: $f not found; is this the vllm-ascend image?" >&2
    fi
done

# The driver's user-space libraries are mounted from the host at run time
# (see deploy/README.md).
export LD_LIBRARY_PATH="/usr/local/Ascend/driver/lib64/common:/usr/local/Ascend/driver/lib64/driver${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"

if [ "$#" -eq 0 ]; then
    echo "usage: with-cann-env COMMAND [ARG...]" >&2
    exit 64
fi
exec "$@"
