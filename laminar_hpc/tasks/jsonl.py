"""The dataset loader's name before Parquet: `JsonlTasks` is tasks/dataset.py's `DatasetTasks`."""
from laminar_hpc.tasks.dataset import DatasetError, DatasetTasks, gsm8k_gold

JsonlTasks = DatasetTasks
__all__ = ["DatasetError", "DatasetTasks", "JsonlTasks", "gsm8k_gold"]
