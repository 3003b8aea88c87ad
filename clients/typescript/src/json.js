// JSON with the contract's unsigned 64-bit integers (`generation`, `highest`) as bigint.

import { randomBytes } from 'node:crypto';

const BIG_MEMBER = /"(generation|highest)"\s*:\s*(\d+)/g;

/**
 * JSON.parse, with `generation` and `highest` as bigint: they are unsigned 64-bit integers,
 * beyond what a JavaScript number holds exactly.
 * @param {string} text
 */
export function parseJson(text) {
  const marked = text.replace(BIG_MEMBER, (_, name, digits) => `"${name}":"\\u0000${digits}"`);
  return JSON.parse(marked, (key, value) =>
    (key === 'generation' || key === 'highest') && typeof value === 'string' && value.startsWith('\u0000')
      ? BigInt(value.slice(1))
      : value);
}

// Marks a bigint while JSON.stringify writes it: random per process, so that no string a caller
// sends (a checkpoint of NUL and digits) is taken for one and written as a number.
const MARK = `\u0000${randomBytes(8).toString('hex')}:`;
const MARKED = new RegExp(`"\\\\u0000${MARK.slice(1)}(\\d+)"`, 'g');

/**
 * JSON.stringify, writing bigint members as JSON integers.
 * @param {object} body
 */
export function stringifyJson(body) {
  return JSON.stringify(body, (_, value) => (typeof value === 'bigint' ? `${MARK}${value}` : value))
    .replace(MARKED, '$1');
}

const LEASE_KEY_VALUE = /(lease_key\W{0,8}?)[A-Za-z0-9_-]{8,}/g;

/**
 * `text` (an answer quoted into a message) with any lease_key value replaced: an endpoint that
 * echoes the request would otherwise put the lease's proof into errors and loss reasons, which
 * end up in logs.
 * @param {string} text
 */
export function redact(text) {
  return String(text).replace(LEASE_KEY_VALUE, '$1<redacted>');
}
