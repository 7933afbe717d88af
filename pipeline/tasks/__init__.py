"""What post-training, evaluation and serving share about tasks: the chat format, chat and preference data files,
task files and the built-in reading task's items, multiple-choice tasks, and GRPO's rewards. A library below the
stages: post, evaluate and serve import it, it imports none of them."""
