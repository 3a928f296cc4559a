hooks = []


def register_optimizer_step_post_hook(hook):
    hooks.append(hook)
