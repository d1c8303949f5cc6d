"""Generated from proto/minipaged/v1 by scripts/gen_proto.py. Do not edit."""
