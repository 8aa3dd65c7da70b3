"""The picker's gRPC health (grpc.health.v1, as Envoy's health checks and Kubernetes probes ask it).

Services: ``liveness`` (SERVING while the process runs), ``readiness`` and the ext_proc service name
(SERVING once the picker serves, NOT_SERVING while it drains at shutdown, so Envoy moves to the other
replicas), and ``""`` (the server as a whole, like readiness). Any other name is SERVICE_UNKNOWN, which
grpc.health.v1 turns into the NOT_FOUND status.
"""

from __future__ import annotations

from grpc_health.v1 import health_pb2

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
CHECK_METHOD = "/grpc.health.v1.Health/Check"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class PickerHealth:
    def __init__(self) -> None:
        self.ready = False

    def status(self, service: str) -> int | None:
        """The service's status, or None for a service this server does not know."""
        if service == "liveness":
            return SERVING
        if service in ("readiness", EXT_PROC_SERVICE, ""):
            return SERVING if self.ready else NOT_SERVING
        return None

    def check(self, request: bytes) -> bytes | None:
        """A serialized HealthCheckRequest answered; None for an unknown service."""
        service = health_pb2.HealthCheckRequest.FromString(request).service
        status = self.status(service)
        if status is None:
            return None
        return health_pb2.HealthCheckResponse(status=status).SerializeToString()
