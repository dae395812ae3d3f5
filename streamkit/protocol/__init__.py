"""Wire schema (generated protobuf/gRPC code) and validated spec models.

Nothing here imports the rest of streamkit; every other package imports this.
"""

from streamkit.protocol import broker_pb2 as pb
from streamkit.protocol import broker_pb2_grpc as pb_grpc
from streamkit.protocol import consumer_pb2 as consumer_pb

__all__ = ["consumer_pb", "pb", "pb_grpc"]
