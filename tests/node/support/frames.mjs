// A stream's frames, read one at a time with a deadline on each, and how the stream ended.
import { within } from './server.mjs';

const FRAME_WITHIN_MS = 10_000;

export class Frames {
  /**
   * @param {AsyncIterable<unknown>} stream what the client returned for the call
   * @param {() => void} cancel cancels the call (for cleanup; the call may have ended)
   * @param {(frame: unknown) => string | undefined} stateOf the frame's task state, if any
   */
  constructor(stream, cancel, stateOf) {
    this.iterator = stream[Symbol.asyncIterator]();
    this.cancel = cancel;
    this.stateOf = stateOf;
    this.frames = [];
    this.ended = false;
    this.error = null; // what the stream ended with, if not a clean end (status OK)
  }

  /** The next frame, or undefined once the stream ended (cleanly or with `this.error`). */
  async next(ms = FRAME_WITHIN_MS) {
    if (this.ended) return undefined;
    let step;
    try {
      step = await within(this.iterator.next(), ms, 'the next frame');
    } catch (err) {
      if (/^timed out/.test(err.message)) {
        this.cancel();
        throw new Error(`${err.message}; states so far: ${this.states().join(', ')}`);
      }
      this.ended = true;
      this.error = err;
      return undefined;
    }
    if (step.done) {
      this.ended = true;
      return undefined;
    }
    this.frames.push(step.value);
    return step.value;
  }

  /** Read until a frame whose state is `state`; return it (fails if the stream ends first). */
  async until(state, ms = FRAME_WITHIN_MS) {
    for (;;) {
      const frame = await this.next(ms);
      if (frame === undefined) {
        throw new Error(`stream ended before ${state} (states: ${this.states().join(', ')}; `
          + `error: ${this.error?.message ?? 'none'})`);
      }
      if (this.stateOf(frame) === state) return frame;
    }
  }

  /** Read to the end of the stream; return this. */
  async drain(ms = FRAME_WITHIN_MS) {
    while ((await this.next(ms)) !== undefined);
    return this;
  }

  /** The task state each frame carried, in order ('-' for a frame without one). */
  states() {
    return this.frames.map((f) => this.stateOf(f) ?? '-');
  }

  /** The state of the stream's last frame. */
  lastState() {
    return this.frames.length ? this.stateOf(this.frames[this.frames.length - 1]) : undefined;
  }
}
