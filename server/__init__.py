"""qwen35_tvm.server"""
