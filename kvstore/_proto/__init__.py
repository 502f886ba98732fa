"""Generated gRPC code for proto/kvstore/v1 (tools/gen_proto.py); never edited by hand."""
