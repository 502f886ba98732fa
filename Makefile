.PHONY: proto test demo lint

# Regenerate kvstore/_proto from proto/ (tests/unit/test_proto_fresh.py fails when this is due).
proto:
	.venv/bin/python tools/gen_proto.py

test:
	./dev test

demo:
	./dev demo

lint:
	.venv/bin/ruff check .
