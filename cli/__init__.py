"""qwen35_tvm.cli"""
