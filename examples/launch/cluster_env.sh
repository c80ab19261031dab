# Environment for multi-node CUDA runs; sourced by the launch scripts (override any variable before).
#
# One hardware work queue per GPU: kernels of every stream reach the GPU in the order the host issued
# them. The overlap relies on this: a communication kernel (NCCL, DeepEP) issued just before the compute
# kernel it hides behind starts first and runs beside it on its reserved SMs, rather than the GPU filling
# its SMs from the compute queue and starting the communication late (Megatron sets it for the same
# reason, to overlap tensor/sequence-parallel communication). The price: work on one stream that waits
# for an event holds back what other streams issued after it.
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
