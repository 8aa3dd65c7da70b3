"""What both front ends (the proxy and the Envoy picker) share: engines, scheduling, prefix knowledge."""
