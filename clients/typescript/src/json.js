// JSON with the contract's unsigned 64-bit integers (`generation`, `highest`) as bigint.

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

/**
 * JSON.stringify, writing bigint members as JSON integers.
 * @param {object} body
 */
export function stringifyJson(body) {
  return JSON.stringify(body, (_, value) => (typeof value === 'bigint' ? `\u0000${value}` : value))
    .replace(/"\\u0000(\d+)"/g, '$1');
}
