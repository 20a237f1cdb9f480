"""qwen35_tvm.runtime"""
