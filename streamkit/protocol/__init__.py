"""Wire schema (generated protobuf/gRPC code) and validated spec models.

Nothing here imports the rest of streamkit; every other package imports this.
"""

from streamkit.protocol import broker_pb2 as pb
from streamkit.protocol import broker_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
