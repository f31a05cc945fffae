"""The gRPC server (thin servicer over a backend), its protobuf conversions and client."""
