"""qwen35_tvm.schedules"""
