"""Task sources (built-in sets, JSONL/CSV files, datasets) and the built-in demo task."""

from grooves.tasks.sources import TaskSourceError, TaskStream, load_tasks, render_prompt, split_tasks

__all__ = ["TaskSourceError", "TaskStream", "load_tasks", "render_prompt", "split_tasks"]
