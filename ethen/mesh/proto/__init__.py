"""Generated gRPC/protobuf modules for the mesh data plane (source: ``mesh.proto``; regenerate with
``bash ethen/mesh/proto/generate.sh``)."""

from ethen.mesh.proto import mesh_pb2, mesh_pb2_grpc

__all__ = ["mesh_pb2", "mesh_pb2_grpc"]
