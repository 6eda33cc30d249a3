"""One optimizer step of a training loop, shared by the tests that train."""


def optimizer_step(loss, opt, scaler=None) -> None:
    """zero_grad, backward and step; with a loss scaler (torch's GradScaler interface) the scaled
    loss's backward, the scaler's step and its update."""
    opt.zero_grad()
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
