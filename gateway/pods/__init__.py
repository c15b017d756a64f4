from gateway.pods.pod import Pod
from gateway.pods.pool import PodPool

__all__ = ["Pod", "PodPool"]
