"""Data planes beside the gRPC byte streams (DESIGN.md §8). gRPC streaming always works; `shm` moves
page bytes through a same-host shared-memory segment, negotiated by the client over gRPC."""
