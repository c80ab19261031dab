# Environment for multi-node CUDA runs; sourced by the launch scripts (override any variable before).
#
# One communication path per GPU: NCCL and DeepEP queue kernels in issue order on each connection, and
# DualPipe's overlap relies on communication and compute kernels not serialising behind each other.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# The network interface NCCL's bootstrap and gloo use (e.g. eth0, bond0): IFNAME=eth0 sets both.
# Without it NCCL avoids loopback and docker bridges, and gloo takes the interface of the hostname.
if [ -n "${IFNAME:-}" ]; then
    export NCCL_SOCKET_IFNAME=$IFNAME GLOO_SOCKET_IFNAME=$IFNAME
else
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
fi
# InfiniBand HCAs for inter-node traffic (leave unset to let NCCL pick all of them).
# export NCCL_IB_HCA=mlx5_0,mlx5_1,...
# Restarts (--max-restarts) must not read the dead attempt's addresses from a rendezvous store shared
# across attempts (pytorch/pytorch#135712: gloo/NCCL then connect to ports nobody listens on).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
# Surface NCCL failures as Python exceptions instead of hangs, so torchrun can restart the job.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
