package pdsim

// stopsAtOnce says whether req's answer is one token that ends it as a stop
// token would (Config.StopOneToken): at a prefill, unless the request
// forbids a stop there with min_tokens or ignore_eos. On vLLM the stop checks
// come before the length check (check_stop, vllm/v1/core/sched/utils.py
// @ 018d5dc7), so such an answer finishes stopped, though its limit was 1.
func (s *Server) stopsAtOnce(req *request) bool {
	n, _ := req.outputTokens(s.cfg.OutputTokens)
	return s.cfg.StopOneToken && s.cfg.Role == RolePrefill && n == 1 && req.minTokens < 1 && !req.ignoreEOS
}
