"""qwen35_tvm.compile"""
