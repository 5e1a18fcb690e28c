"""Deployment: merge an adapter into its base model, export it as a PEFT folder."""

from grooves.serve.export import ExportError, export_adapter, merge_checkpoint

__all__ = ["ExportError", "export_adapter", "merge_checkpoint"]
